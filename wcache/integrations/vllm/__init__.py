"""A vLLM model loader: ``vllm serve DIR --load-format wcache`` maps the weights from a daemon.

Registered through vLLM's public loader registry (``register_model_loader``) by the
``vllm.general_plugins`` entry point ``wcache`` (pyproject.toml: :func:`register`), which vLLM runs in
every process it starts. Written against vLLM 0.33's loader API, after its own IPC weight-cache loader:

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
   quantization fields of :func:`recipe_quantization`, this plugin's post-processing version, the engine
   configuration's digest, device type and capability). When the daemon lacks it, the load above runs, its
   post-processing is observed module by module (:func:`plan_postprocessing`), and the model's
   post-processed state is deposited: every real parameter and buffer (kind parameter / buffer, tied names
   as aliases) plus the plan (``PLAN_TENSOR``), except the tensors of modules whose result lives in opaque
   kernel handles (vLLM's CPU linear layers: ``(0,)`` placeholders), which no cache can serve. When the
   daemon has it, the model is built on meta, every deposited name is registered (also names the built
   model lacks, as vLLM's own daemon loader does), the "rebuild" modules get their checkpoint tensors (load
   layout) from the daemon, and each module's post-processing runs as the plan says: ``preprocessed``
   (under ``weights_already_processed()``: the method rebuilds its Python-side state only), ``rerun`` (its
   post-processing left the tensors as they were: it runs again on the same bytes) or ``rebuild`` (runs
   normally on the checkpoint tensors). A failed deposit never fails the load (one WARNING).

Extra config (``--model-loader-extra-config '{...}'``, :mod:`.options`): ``socket`` (daemon socket path;
default: wcache's default path for the rank), ``mode`` (``zero_copy`` | ``copy``),
``fallback`` (bool), ``timeout`` (seconds), ``transform`` (the daemon's ``--transform``),
``plan_file``, ``deposit`` (bool, default true: write back / map the post-processed state; false
loads the checkpoint tensors and post-processes on every start).

Logs go to the ``vllm.wcache`` logger, a child of vLLM's own, so one INFO line per load (key,
mode, tensors, bytes, ms) appears in vLLM's log output next to its lines.

The modules, one concern each; only :mod:`.loader` needs vLLM (``register()`` imports it; :mod:`.recipe`
reads vLLM's compile factors where vLLM is installed), so the others are tested without vLLM:

- :mod:`.options` — ``LOAD_FORMAT`` and the extra config;
- :mod:`.checks` — the quantization and parallel-layout refusals;
- :mod:`.recipe` — the recipe key of a rank's post-processed state;
- :mod:`.plan` — post-processing observed module by module, and the plan a deposit carries and a later start
  follows;
- :mod:`.deposit` — what a deposit of a model's state carries, and the write-back;
- :mod:`.attach` — fetched tensors onto the model built on meta (vLLM's names, casts, parameter classes,
  registration) and the count of what the model keeps;
- :mod:`.info` — the leases and the load record a model carries (:func:`model_info`);
- :mod:`.loader` — ``WCacheModelLoader``, composing them.
"""

from __future__ import annotations

from wcache.integrations.vllm.attach import (
    by_module_name,
    cast_to_built,
    count_module_state,
    restore_parameter_classes,
    zero_copy_parameters,
)
from wcache.integrations.vllm.checks import SERVED_QUANTIZATION, check_engine, check_parallel, check_quantization
from wcache.integrations.vllm.deposit import deposit_tensors
from wcache.integrations.vllm.info import CHECKPOINT_WEIGHTS_ATTR, INFO_ATTR, WEIGHTS_ATTR, cached_weights, model_info
from wcache.integrations.vllm.options import DEFAULT_TRANSFORM, EXTRA_CONFIG_KEYS, LOAD_FORMAT, parse_extra_config
from wcache.integrations.vllm.plan import (
    PLAN_ATTR,
    PLAN_MODES,
    PLAN_TENSOR,
    decode_plan,
    encode_plan,
    plan_postprocessing,
    snapshot_postprocessing,
)
from wcache.integrations.vllm.recipe import (
    POSTPROCESS_VERSION,
    device_recipe,
    engine_config_digest,
    recipe_key,
    recipe_quantization,
)

__all__ = [
    "CHECKPOINT_WEIGHTS_ATTR",
    "DEFAULT_TRANSFORM",
    "EXTRA_CONFIG_KEYS",
    "INFO_ATTR",
    "LOAD_FORMAT",
    "PLAN_ATTR",
    "PLAN_MODES",
    "PLAN_TENSOR",
    "POSTPROCESS_VERSION",
    "SERVED_QUANTIZATION",
    "WEIGHTS_ATTR",
    "by_module_name",
    "cached_weights",
    "cast_to_built",
    "check_engine",
    "check_parallel",
    "check_quantization",
    "count_module_state",
    "decode_plan",
    "deposit_tensors",
    "device_recipe",
    "encode_plan",
    "engine_config_digest",
    "model_info",
    "parse_extra_config",
    "plan_postprocessing",
    "recipe_key",
    "recipe_quantization",
    "register",
    "restore_parameter_classes",
    "snapshot_postprocessing",
    "zero_copy_parameters",
]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add ``--load-format wcache`` to vLLM (the loader module, and
    vLLM with it, imported here: the rest of the plugin never imports vLLM)."""
    from vllm.model_executor.model_loader import register_model_loader

    from wcache.integrations.vllm.loader import WCacheModelLoader

    register_model_loader(LOAD_FORMAT)(WCacheModelLoader)
