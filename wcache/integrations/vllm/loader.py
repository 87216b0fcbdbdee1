"""``WCacheModelLoader``: vLLM's ``BaseModelLoader`` for ``--load-format wcache`` (the package docstring says what
it does, in order). The one module of the plugin that imports vLLM: ``register()`` imports it when vLLM runs the
entry point; everything it composes is vLLM-free and tested without vLLM."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import vllm
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader import base_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.model_executor.utils import weights_already_processed
from vllm.utils.torch_utils import set_default_torch_dtype

from wcache.client import CachedWeights, WCacheClient
from wcache.errors import CacheUnavailableError, IncompatibleModelError, KeyMismatchError, NotFoundError, WCacheError
from wcache.integrations.vllm.attach import (
    attach_rebuilt,
    by_module_name,
    cast_to_built,
    count_module_state,
    parameter_attributes,
    rebuild_names,
    register_deposit,
    restore_attributes,
    restore_parameter_classes,
    zero_copy_parameters,
)
from wcache.integrations.vllm.checks import check_engine
from wcache.integrations.vllm.deposit import write_back
from wcache.integrations.vllm.info import INFO_ATTR, hold
from wcache.integrations.vllm.options import parse_extra_config
from wcache.integrations.vllm.plan import PLAN_TENSOR, count_modes, decode_plan, following_plan, observing
from wcache.integrations.vllm.recipe import recipe_key
from wcache.nn import attach, empty_parameters
from wcache.plan.key import WeightCacheKey
from wcache.plan.recipe import RecipeKey

__all__ = ["WCacheModelLoader"]

# a child of vLLM's "vllm" logger: vLLM's handler prints it (its loggers do not propagate to the root)
log = logging.getLogger("vllm.wcache")


def _is_method(qm: Any) -> bool:
    return isinstance(qm, QuantizeMethodBase)


def _observed_postprocessing(model: nn.Module, model_config: Any, device: torch.device) -> None:
    """vLLM's post-processing, with what it did to each module recorded as the deposit's plan."""
    with observing(model, _is_method):
        process_weights_after_loading(model, model_config, device)


@contextlib.contextmanager
def _observing_default_postprocessing() -> Iterator[None]:
    """vLLM's default loader, with its post-processing observed (the name it calls, for this load)."""
    original = base_loader.process_weights_after_loading
    base_loader.process_weights_after_loading = _observed_postprocessing
    try:
        yield
    finally:
        base_loader.process_weights_after_loading = original


class WCacheModelLoader(BaseModelLoader):  # type: ignore[misc]
    """``--load-format wcache``: weights from a wcache daemon (see the package docstring)."""

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

    def _client(self, device: torch.device | None = None) -> WCacheClient:
        return WCacheClient(self.options["socket"], timeout=self.options["timeout"], device=device)

    def _fetch(
        self, model_config: Any, mode: str, device: torch.device | None = None, key: WeightCacheKey | None = None
    ) -> CachedWeights:
        """The checkpoint's tensors for ``key`` (the load's one checkpoint key; computed here when None)."""
        return self._client(device).fetch_sync(key if key is not None else self._key(model_config), mode=mode)

    def _build(self, vllm_config: Any, model_config: Any, prefix: str, device: torch.device) -> nn.Module:
        """The model with its parameters on meta (buffers computed at init, like rotary caches, are real)."""
        with set_default_torch_dtype(model_config.dtype), device, empty_parameters():
            model: nn.Module = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        return model

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
        """The deposit when the daemon has the recipe; else the checkpoint tensors from the daemon, then the
        deposit; else (a WCacheError, fallback on) vLLM's default loader, then the deposit when a daemon
        answered. Permanent misconfigurations (``check_engine``) raise even with fallback on."""
        check_engine(vllm_config, model_config)
        device = torch.device(self.load_config.device or vllm_config.device_config.device)
        recipe = None  # set when the daemon lacks the recipe: deposit after loading
        # one checkpoint key for the whole load: the recipe's base, the tensors fetched for it or for the deposit's
        # rebuilt modules (a key computed again could name a checkpoint changed meanwhile, mixed with the other's)
        base = self._key(model_config)
        try:
            if self.options["deposit"]:
                model, recipe = self._try_deposit(vllm_config, model_config, prefix, device, base)
                if model is not None:
                    return model
            model = self._load_from_cache(vllm_config, model_config, prefix, base)
        except WCacheError as exc:
            if not self.options["fallback"]:
                raise
            model = self._load_from_disk(vllm_config, model_config, prefix, exc)
            if isinstance(exc, CacheUnavailableError):
                recipe = None  # no daemon to deposit into
            elif recipe is not None and not self._unchanged(model_config, base):
                recipe = None
        if recipe is not None:
            self._deposit(model, recipe)
        return model

    def _unchanged(self, model_config: Any, base: WeightCacheKey) -> bool:
        """Whether the checkpoint vLLM just loaded from disk still has the key ``base`` that the recipe to deposit
        was made from: a checkpoint changed meanwhile would deposit its weights under the older one's recipe. A
        change is one WARNING and no deposit (the next start deposits)."""
        try:
            was = base.resolve()  # a key only stated so far is scanned now (the files as they are now)
            now = self._key(model_config).resolve()
        except WCacheError as exc:
            why = f"{type(exc).__name__}: {exc}"
        else:
            if now == was:
                return True
            why = f"its key was {was.short()}, is {now.short()}"
        log.warning("wcache: %s changed while it loaded from disk (%s); not depositing it", model_config.model, why)
        return False

    def _try_deposit(
        self, vllm_config: Any, model_config: Any, prefix: str, device: torch.device, base: WeightCacheKey
    ) -> tuple[nn.Module | None, RecipeKey | None]:
        """The model mapped from its deposit, or None and the recipe to deposit once it is loaded otherwise:
        the daemon lacks the recipe, or its deposit did not fit this build (any error but a WCacheError, which
        propagates: the daemon is absent or refused). An unusable deposit holds no lease now and is replaced."""
        wanted = recipe_key(base, model_config, device, vllm.__version__, vllm_config)
        try:
            return self._load_from_deposit(vllm_config, model_config, prefix, wanted, device, base), None
        except (KeyMismatchError, NotFoundError):
            return None, wanted  # not deposited yet: this start loads, post-processes, deposits
        except WCacheError:
            raise
        except Exception as exc:  # the deposit did not fit this build: never lose the load over it
            log.warning(
                "wcache: the deposit of %s could not be used (%s: %s); loading the checkpoint instead and "
                "depositing again",
                model_config.model,
                type(exc).__name__,
                exc,
            )
            return None, wanted

    def _load_from_disk(self, vllm_config: Any, model_config: Any, prefix: str, exc: WCacheError) -> nn.Module:
        """vLLM's default loader after ``exc`` (one WARNING naming it), its post-processing observed. A directory
        filled from a peer holds headers, not weights: that is a CheckpointError here, never zeros loaded."""
        from wcache.peer_files import refuse_stub_dir

        refuse_stub_dir(model_config.model)
        reason = f"{type(exc).__name__}: {exc}"
        log.warning(
            "wcache: %s loaded with vLLM's default loader instead of the cache (%s)", model_config.model, reason
        )
        with _observing_default_postprocessing():
            model: nn.Module = DefaultModelLoader(self._fallback_config()).load_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
        model.__dict__[INFO_ATTR] = {"origin": "disk", "reason": reason}
        return model

    def _deposit(self, model: nn.Module, key: RecipeKey) -> None:
        """Write the post-processed state back (docs/protocol.md §4.13); a failure is one WARNING."""
        write_back(model, key, self._client(), self.options["timeout"])

    def _load_from_deposit(
        self,
        vllm_config: Any,
        model_config: Any,
        prefix: str,
        key: RecipeKey,
        device: torch.device,
        base: WeightCacheKey,
    ) -> nn.Module:
        """Build on meta, register every deposited tensor, give the ``rebuild`` modules their checkpoint
        tensors (those of ``base``, the recipe's checkpoint key), post-process each module as the deposit's plan
        says. KeyMismatchError / NotFoundError when the daemon lacks the recipe."""
        started = time.perf_counter()
        mode = self.options["mode"]
        weights = self._client(device).fetch_sync(key, mode=mode)
        raw = None
        try:
            if PLAN_TENSOR not in weights:
                raise IncompatibleModelError(f"the deposit {key.short()} carries no {PLAN_TENSOR}")
            plan = decode_plan(weights[PLAN_TENSOR])
            model = self._build(vllm_config, model_config, prefix, device)
            attrs = parameter_attributes(model)
            registered = register_deposit(model, weights, clone_buffers=mode == "zero_copy")
            wanted = rebuild_names(model, plan, registered)
            from_checkpoint = 0
            if wanted:
                raw = self._fetch(model_config, mode, device, base)
                from_checkpoint = attach_rebuilt(model, raw, wanted)
            restore_attributes(model, attrs)
            with following_plan(model, plan, _is_method, weights_already_processed) as ms:
                process_weights_after_loading(model, model_config, device)
        except BaseException:
            weights.release_sync()
            if raw is not None:
                raw.release_sync()
            raise
        if mode == "zero_copy":
            hold(model, weights, raw)
        copied = {id(t) for n, t in registered.items() if n in weights.buffers and mode == "zero_copy"}
        counts = count_module_state(model, weights, copied)
        info = model.__dict__[INFO_ATTR] = {
            "origin": "deposit",
            "mode": mode,
            "key": key.short(),
            "tensors": len({id(t) for t in registered.values()}),  # distinct tensors (tied names once), no plan
            "from_checkpoint": from_checkpoint,
            **counts,
            "modules": count_modes(plan),
            "postprocess_ms": ms,
            "ms": (time.perf_counter() - started) * 1e3,
        }
        log.info(
            "wcache: loaded %s from its deposit key=%s mode=%s tensors=%d module_state=%d mapped=%d copied=%d "
            "recreated=%d from_checkpoint=%d rebuild_ms=%.1f ms=%.1f socket=%s",
            model_config.model,
            key.short(),
            mode,
            info["tensors"],
            counts["module_state"],
            counts["mapped"],
            counts["copied"],
            len(counts["recreated"]),
            from_checkpoint,
            ms["rebuild"],
            info["ms"],
            weights.socket_path,
        )
        return model.eval()

    def _load_from_cache(
        self, vllm_config: Any, model_config: Any, prefix: str, base: WeightCacheKey | None = None
    ) -> nn.Module:
        """The checkpoint tensors of ``base`` (vLLM's load layout; computed here when None) from the daemon onto
        the model built on meta, then vLLM's post-processing, observed for the deposit."""
        started = time.perf_counter()
        device = torch.device(self.load_config.device or vllm_config.device_config.device)
        mode = self.options["mode"]
        weights = self._fetch(model_config, mode, device, base)
        try:
            model = self._build(vllm_config, model_config, prefix, device)
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
            hold(model, weights)  # the lease lives as long as the module: vLLM drops this loader after load_model
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
