"""Load a Hugging Face causal LM (TP=1) with its weights from a wcache daemon.

The config comes from the checkpoint directory, the weights from the daemon (zero_copy:
the model's parameters are views of the daemon's memory). When the daemon is absent,
refuses, or serves another key, this falls back to ``AutoModelForCausalLM.from_pretrained``
with one warning naming the reason; ``fallback=False`` raises instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from wcache.errors import WCacheError
from wcache.nn import LoadedWeights, attach, empty_parameters, load_weights

__all__ = ["from_pretrained"]

log = logging.getLogger("wcache.transformers")


async def from_pretrained(
    model_dir: str | os.PathLike[str],
    *,
    client: Any = None,
    mode: str = "zero_copy",
    dtype: str | None = None,
    fallback: bool = True,
) -> tuple[Any, LoadedWeights | None]:
    """(model, weights handle) — release the handle with ``await weights.release()`` when done.

    The handle is None when the model came from ``from_pretrained`` (fallback).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    try:
        weights = await load_weights(model_dir, dtype=dtype, mode=mode, client=client, fallback=False)
    except WCacheError as exc:
        if not fallback:
            raise
        log.warning(
            "wcache: %s loaded with from_pretrained instead of the cache (%s: %s)", model_dir, type(exc).__name__, exc
        )
        kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
        return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs), None
    torch_dtype = next(iter(weights.tensors.values())).dtype
    with empty_parameters():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)  # type: ignore[no-untyped-call]
    attach(model, weights.tensors, strict=False)
    model.eval()
    return model, weights
