"""Load a Hugging Face model (TP=1) with its weights from a wcache daemon.

The config comes from the checkpoint directory, the weights from the daemon (zero_copy:
the model's parameters are views of the daemon's memory, read-only — see wcache.nn). The
model class is the transformers Auto class that builds ``config.architectures[0]``
(``AutoModelForCausalLM`` for ``LlamaForCausalLM``, ``AutoModel`` for ``BertModel``...), or
the ``auto_class`` given; it is built in ``dtype``, else the config's dtype, else the dtype
of the served floating-point tensors. When the daemon is absent, refuses, serves another key,
or its tensors do not build that class, this falls back to ``<class>.from_pretrained`` with
one warning naming the reason; ``fallback=False`` raises instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from wcache.errors import IncompatibleModelError, WCacheError
from wcache.nn import LoadedWeights, attach, empty_parameters, load_weights

__all__ = ["auto_class_for", "from_pretrained"]

log = logging.getLogger("wcache.transformers")

# Tried first, in this order; then every other ``transformers.AutoModelFor*``.
_PREFERRED = ("AutoModelForCausalLM", "AutoModel")


def _builds(auto: Any, config: Any, architecture: str) -> bool:
    try:
        found = auto._model_mapping[type(config)]  # the Auto class's config -> model class mapping
    except Exception:  # KeyError: not this task; ImportError: a model whose extras are missing
        return False
    return any(getattr(c, "__name__", "") == architecture for c in (found if isinstance(found, tuple) else (found,)))


def auto_class_for(config: Any) -> Any:
    """The transformers Auto class that builds ``config.architectures[0]``.

    A config without ``architectures`` gets AutoModelForCausalLM. Raises ValueError naming the
    architecture when no Auto class builds it (remote code, a custom model): pass ``auto_class=``.
    """
    import transformers

    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        return transformers.AutoModelForCausalLM
    arch = architectures[0]
    names = [*_PREFERRED, *sorted(n for n in dir(transformers) if n.startswith("AutoModelFor") and n not in _PREFERRED)]
    for name in names:
        auto = getattr(transformers, name, None)
        if auto is not None and _builds(auto, config, arch):
            return auto
    raise ValueError(
        f"no transformers Auto class builds {arch!r} (config.json architectures); "
        "pass auto_class= (e.g. transformers.AutoModel) to from_pretrained"
    )


def _build_dtype(config: Any, dtype: str | None, tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    """``dtype``, else the config's (``dtype``, formerly ``torch_dtype``), else the served floating-point dtype.

    Never the dtype of whatever tensor comes first: that may be an int64 ``position_ids``.
    """
    if dtype:
        return getattr(torch, dtype)  # type: ignore[no-any-return]
    names = ("dtype", "torch_dtype") if hasattr(config, "dtype") else ("torch_dtype",)
    for attr in names:
        value = getattr(config, attr, None)
        if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            value = getattr(torch, value)
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return value
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    return max(set(floating), key=floating.count) if floating else torch.get_default_dtype()


def _build(auto: Any, config: Any, weights: LoadedWeights, dtype: str | None, model_dir: Any) -> Any:
    """The model on the meta device, then the cached tensors attached; WCacheError if they do not fit."""
    try:
        with empty_parameters():
            model = auto.from_config(config, dtype=_build_dtype(config, dtype, weights.tensors))
        attach(model, weights.tensors, strict=False)
    except WCacheError:
        raise
    except Exception as exc:  # transformers' own refusals (ValueError, TypeError...): the fallback's reason
        raise IncompatibleModelError(
            f"cannot build {auto.__name__} for {model_dir} from the cached tensors: {type(exc).__name__}: {exc}"
        ) from exc
    model.eval()
    return model


async def from_pretrained(
    model_dir: str | os.PathLike[str],
    *,
    client: Any = None,
    mode: str = "zero_copy",
    dtype: str | None = None,
    fallback: bool = True,
    auto_class: Any = None,
) -> tuple[Any, LoadedWeights | None]:
    """(model, weights handle) — release the handle with ``await weights.release()`` when done.

    ``auto_class``: the class to build, a transformers Auto class (``AutoModel``,
    ``AutoModelForMaskedLM``...) or anything with ``from_config(config, dtype=)`` and
    ``from_pretrained``; default: auto_class_for(config), from config.json's architectures.
    Raises ValueError before fetching when no Auto class builds that architecture.
    The handle is None when the model came from ``from_pretrained`` (fallback).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    auto_cls = auto_class if auto_class is not None else auto_class_for(config)
    try:
        weights = await load_weights(model_dir, dtype=dtype, mode=mode, client=client, fallback=False)
        try:
            model = _build(auto_cls, config, weights, dtype, model_dir)
        except BaseException:
            await weights.release()  # the lease must not outlive a model that was never built
            raise
    except WCacheError as exc:
        if not fallback:
            raise
        log.warning(
            "wcache: %s loaded with from_pretrained instead of the cache (%s: %s)", model_dir, type(exc).__name__, exc
        )
        from wcache.peer_files import refuse_stub_dir

        refuse_stub_dir(model_dir)  # a directory filled from a peer holds headers, not weights
        kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
        return auto_cls.from_pretrained(model_dir, **kwargs), None
    return model, weights
